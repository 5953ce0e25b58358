// The gym-rpc head's status page: reads the head's change feed (server-sent events over fetch, so the token goes
// in a header) and draws the fleet. Every text that came from the head (names, labels, addresses, details) goes
// into the DOM through textContent or an attribute, never as markup.
"use strict";

(() => {
  const TOKEN_KEY = "gym-rpc-token";
  const EVENTS_URL = "api/events";
  const MAX_EVENTS = 200;
  const RETRY_FIRST_MS = 500;
  const RETRY_MAX_MS = 5000;

  const state = {
    revision: null,
    configVersion: "",
    servers: new Map(), // name -> server, in the head's order
    events: [], // newest last
    offset: 0, // head clock - this clock, seconds
    heartbeatSeconds: 2,
    head: {},
  };
  const groups = new Map(); // name -> {details, summary cells, body}
  let generation = 0;
  let controller = null;
  let retryMs = RETRY_FIRST_MS;
  let lastHeard = 0;
  let live = false;

  const $ = (id) => document.getElementById(id);

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function headNow() {
    return Date.now() / 1000 + state.offset;
  }

  function duration(seconds) {
    const s = Math.max(0, Math.floor(seconds));
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
    if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
    return `${Math.floor(s / 86400)}d${String(Math.floor((s % 86400) / 3600)).padStart(2, "0")}h`;
  }

  function stateOf(instance) {
    if (instance.draining) return "draining";
    if (instance.status === null || instance.status === undefined) return "pending";
    return instance.status === "success" ? "up" : "down";
  }

  // --- the connection ---------------------------------------------------------------------------------------

  function setConnection(kind, text) {
    const node = $("connection");
    node.dataset.state = kind;
    node.textContent = text;
  }

  function askToken(problem) {
    live = false;
    setConnection("lost", "token needed");
    $("token-form").hidden = false;
    $("token-problem").textContent = problem || "";
    $("token-input").focus();
  }

  function lost(reason, mine) {
    if (mine !== generation) return; // an older connection's end: a newer one runs
    live = false;
    generation += 1;
    const wait = retryMs;
    retryMs = Math.min(retryMs * 2, RETRY_MAX_MS);
    setConnection("lost", `lost the head (${reason}); retrying in ${(wait / 1000).toFixed(1)} s`);
    const next = generation;
    setTimeout(() => {
      if (next === generation) connect();
    }, wait);
  }

  async function connect() {
    generation += 1;
    const mine = generation;
    if (controller) controller.abort();
    controller = new AbortController();
    const token = sessionStorage.getItem(TOKEN_KEY);
    const headers = { Accept: "text/event-stream" };
    if (token) headers.Authorization = `Bearer ${token}`;
    const url = state.revision === null ? EVENTS_URL : `${EVENTS_URL}?since=${state.revision}`;
    if (!live) setConnection(state.revision === null ? "connecting" : "lost", state.revision === null
      ? "connecting" : "reconnecting");
    let response;
    try {
      response = await fetch(url, { headers, cache: "no-store", credentials: "omit", signal: controller.signal });
    } catch (error) {
      lost("no answer", mine);
      return;
    }
    if (response.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      askToken(token ? "The head refused this token." : "");
      return;
    }
    if (!response.ok || !response.body) {
      lost(`HTTP ${response.status}`, mine);
      return;
    }
    $("token-form").hidden = true;
    $("main").hidden = false;
    live = true;
    lastHeard = Date.now();
    setConnection("live", "live");
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        lastHeard = Date.now();
        retryMs = RETRY_FIRST_MS;
        buffer += decoder.decode(value, { stream: true });
        let end = buffer.indexOf("\n\n");
        while (end >= 0) {
          onFrame(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
          end = buffer.indexOf("\n\n");
        }
      }
    } catch (error) {
      // the connection broke (the head went away, or the watchdog below gave up on it)
    }
    lost("the stream ended", mine);
  }

  // A head that stopped answering without closing the connection (stopped, or a network gone): no heartbeat.
  setInterval(() => {
    if (live && Date.now() - lastHeard > (3 * state.heartbeatSeconds + 1) * 1000) {
      lost("no heartbeat", generation);
      if (controller) controller.abort();
    }
  }, 1000);

  function onFrame(text) {
    let kind = "message";
    const data = [];
    for (const line of text.split("\n")) {
      if (line.startsWith("event:")) kind = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
    }
    if (!data.length) return;
    const message = JSON.parse(data.join("\n"));
    if (kind === "snapshot") onSnapshot(message);
    else if (kind === "change") onChange(message);
    else if (kind === "heartbeat") onHeartbeat(message);
  }

  function onSnapshot(message) {
    state.revision = message.revision;
    state.configVersion = message.config_version;
    state.offset = message.now - Date.now() / 1000;
    state.heartbeatSeconds = message.heartbeat_seconds || 2;
    state.head = message.head || {};
    state.servers = new Map(message.servers.map((server) => [server.name, server]));
    state.events = message.events.slice(-MAX_EVENTS);
    for (const name of [...groups.keys()]) {
      if (!state.servers.has(name)) removeGroup(name);
    }
    for (const server of state.servers.values()) drawServer(server);
    orderGroups();
    drawEvents(true);
    drawFacts();
    applyFilters();
  }

  function onChange(message) {
    state.revision = message.revision;
    state.configVersion = message.config_version;
    let added = false;
    for (const server of message.servers) {
      added = added || !state.servers.has(server.name);
      state.servers.set(server.name, server);
      drawServer(server);
    }
    for (const name of message.removed) {
      state.servers.delete(name);
      removeGroup(name);
    }
    if (added) orderGroups();
    state.events.push(...message.events);
    if (state.events.length > MAX_EVENTS) state.events.splice(0, state.events.length - MAX_EVENTS);
    drawEvents(false, message.events);
    drawFacts();
    applyFilters();
  }

  function onHeartbeat(message) {
    state.offset = message.now - Date.now() / 1000;
    if (message.revision !== state.revision) return; // a change is on its way
    for (const [name, ages] of Object.entries(message.ago)) {
      const server = state.servers.get(name);
      if (!server) continue;
      const flights = message.in_flight[name] || [];
      const engines = (message.engine || {})[name] || [];
      server.instances.forEach((instance, i) => {
        instance.checked = ages[i] === null || ages[i] === undefined ? null : message.now - ages[i];
        instance.in_flight = flights[i] === undefined ? instance.in_flight : flights[i];
        if (engines.length) instance.engine = engines[i] || null;
      });
    }
    for (const [name, group] of groups) {
      if (group.details.open) drawBody(state.servers.get(name), group);
    }
  }

  // --- drawing --------------------------------------------------------------------------------------------------

  function drawFacts() {
    let up = 0;
    let total = 0;
    for (const server of state.servers.values()) {
      up += server.up;
      total += server.total;
    }
    $("count-servers").textContent = String(state.servers.size);
    $("count-instances").textContent = `${up}/${total}`;
    $("config-version").textContent = state.configVersion || "-";
    $("revision").textContent = String(state.revision);
    $("head-address").textContent = state.head.address || "-";
  }

  function removeGroup(name) {
    const group = groups.get(name);
    if (group) group.details.remove();
    groups.delete(name);
  }

  function orderGroups() {
    const container = $("servers");
    for (const name of state.servers.keys()) container.appendChild(groups.get(name).details);
  }

  function drawServer(server) {
    let group = groups.get(server.name);
    if (!group) {
      const details = el("details", "server");
      details.dataset.name = server.name;
      const summary = el("summary");
      const count = el("span", "count");
      const name = el("span", "name", server.name);
      const type = el("span", "type");
      const url = el("span", "url");
      summary.append(count, name, type, url);
      details.append(summary);
      group = { details, count, type, url, body: null };
      details.addEventListener("toggle", () => {
        if (details.open) drawBody(state.servers.get(server.name), group);
      });
      groups.set(server.name, group);
      $("servers").appendChild(details);
    }
    group.count.textContent = `${server.up}/${server.total}`;
    group.count.className = `count ${server.up === server.total ? "all" : server.up ? "some" : "none"}`;
    group.type.textContent = server.type;
    group.url.textContent = server.url;
    if (group.details.open) drawBody(server, group);
  }

  const COLUMNS = ["instance", "status", "last check", "labels", "draining", "pid", "uptime", "in flight",
    "engine", "origin"];

  function drawBody(server, group) {
    if (!server) return;
    const table = el("table", "instances");
    const head = el("tr");
    for (const column of COLUMNS) head.append(el("th", null, column));
    table.append(head);
    const now = headNow();
    for (const instance of server.instances) {
      if (!instanceShown(instance)) continue;
      const row = el("tr");
      row.dataset.instance = instance.id;
      const kind = stateOf(instance);
      row.dataset.state = kind;
      row.append(el("td", null, instance.url));
      const status = el("td", `status ${kind}`, instance.status || "pending");
      if (instance.detail) status.title = instance.detail;
      row.append(status);
      row.append(el("td", null, instance.checked ? `${Math.max(0, now - instance.checked).toFixed(1)} s ago` : "never"));
      const labels = el("td", "labels");
      for (const [key, value] of Object.entries(instance.labels || {})) labels.append(el("span", "label", `${key}=${value}`));
      row.append(labels);
      row.append(el("td", null, instance.draining ? "yes" : "-"));
      row.append(el("td", null, instance.pid || "-"));
      row.append(el("td", null, instance.started ? duration(now - instance.started) : "-"));
      row.append(el("td", "in-flight", instance.in_flight === null || instance.in_flight === undefined
        ? "-" : instance.in_flight));
      const engine = instance.engine ? engineText(instance.engine) : "-";
      row.append(el("td", "engine", engine));
      row.append(el("td", "muted", instance.origin || "-"));
      table.append(row);
    }
    const body = el("div", "instances-wrap");
    body.append(table);
    if (group.body) group.body.replaceWith(body);
    else group.details.append(body);
    group.body = body;
  }

  function engineText(load) {
    const parts = [];
    if (load.queue !== undefined) parts.push(`queue ${load.queue}`);
    if (load.running !== undefined) parts.push(`running ${load.running}`);
    if (load.kv !== undefined) parts.push(`KV ${Math.round(load.kv * 100)}%`);
    return parts.join(", ") || "-";
  }

  function eventNode(event) {
    const item = el("li", event.tone);
    const at = new Date(event.at * 1000);
    item.append(el("time", null, at.toLocaleTimeString([], { hour12: false })));
    const who = [event.server, event.instance].filter(Boolean).join(" ");
    if (who) item.append(el("span", "who", who));
    item.append(el("span", "what", event.text));
    return item;
  }

  function drawEvents(all, fresh) {
    const list = $("events");
    if (all) {
      list.replaceChildren(...state.events.slice().reverse().map(eventNode));
      return;
    }
    for (const event of fresh) list.prepend(eventNode(event));
    while (list.childElementCount > MAX_EVENTS) list.lastElementChild.remove();
  }

  // --- filters --------------------------------------------------------------------------------------------------

  const filters = { name: "", label: "", status: "" };

  function labelMatches(instance) {
    if (!filters.label) return true;
    const pairs = Object.entries(instance.labels || {});
    const [key, value] = filters.label.split("=", 2);
    if (value !== undefined) return pairs.some(([k, v]) => k === key.trim() && v === value.trim());
    const text = filters.label.toLowerCase();
    return pairs.some(([k, v]) => k.toLowerCase().includes(text) || v.toLowerCase().includes(text));
  }

  function instanceShown(instance) {
    return labelMatches(instance) && (!filters.status || stateOf(instance) === filters.status);
  }

  function serverShown(server) {
    if (filters.name && !server.name.toLowerCase().includes(filters.name)) return false;
    if (!filters.label && !filters.status) return true;
    return server.instances.some(instanceShown);
  }

  function applyFilters() {
    let shown = 0;
    for (const [name, group] of groups) {
      const server = state.servers.get(name);
      const visible = Boolean(server) && serverShown(server);
      group.details.hidden = !visible;
      if (visible) shown += 1;
    }
    $("shown").textContent = `${shown} of ${groups.size} shown`;
  }

  function onFilter() {
    filters.name = $("filter-name").value.trim().toLowerCase();
    filters.label = $("filter-label").value.trim();
    filters.status = $("filter-status").value;
    applyFilters();
    for (const [name, group] of groups) {
      if (group.details.open) drawBody(state.servers.get(name), group);
    }
  }

  // --- start ----------------------------------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("token").addEventListener("submit", (event) => {
      event.preventDefault();
      const token = $("token-input").value.trim();
      if (!token) return;
      sessionStorage.setItem(TOKEN_KEY, token);
      $("token-input").value = "";
      $("token-form").hidden = true;
      connect();
    });
    for (const id of ["filter-name", "filter-label"]) $(id).addEventListener("input", onFilter);
    $("filter-status").addEventListener("change", onFilter);
    $("expand-all").addEventListener("click", () => {
      for (const group of groups.values()) if (!group.details.hidden) group.details.open = true;
    });
    $("collapse-all").addEventListener("click", () => {
      for (const group of groups.values()) group.details.open = false;
    });
    connect();
  });
})();

// Calls a gym_rpc head from TypeScript with the stubs `make stubs` generates; prints one JSON line per answer.
// Run: node_modules/.bin/tsx interop/ts/client.ts grpc 127.0.0.1:11000      (gRPC, HTTP/2: the head's port)
//      node_modules/.bin/tsx interop/ts/client.ts connect 127.0.0.1:11002   (Connect, HTTP/1.1: head_server.connect_port)
// It ends after the watch's snapshot; add a count (`... grpc 127.0.0.1:11000 1`) to wait for that many changes
// too, and cause one by stopping or starting a server.
import { toJson } from "@bufbuild/protobuf";
import { createClient } from "@connectrpc/connect";
import { createConnectTransport, createGrpcTransport } from "@connectrpc/connect-node";
import * as v1 from "../../stubs/ts/gym_rpc/v1/control_plane_pb";

const [protocol, address, changes = "0"] = process.argv.slice(2);
const baseUrl = `http://${address}`;
const transport =
  protocol === "connect" ? createConnectTransport({ baseUrl, httpVersion: "1.1" }) : createGrpcTransport({ baseUrl });
const head = createClient(v1.ControlPlaneService, transport);
const calls = new AbortController(); // aborted when done, or after 10 s: the program always ends by itself
setTimeout(() => calls.abort(new Error("gave up after 10 s")), 10_000).unref();
const signal = calls.signal;

const config = await head.getGlobalConfig({}, { signal });
console.log(JSON.stringify({ config: toJson(v1.GetGlobalConfigResponseSchema, config) }));
const statuses = await head.listServerStatuses({}, { signal });
console.log(JSON.stringify({ statuses: toJson(v1.ListServerStatusesResponseSchema, statuses) }));
let received = 0; // the snapshot first, then each change (no heartbeat within a minute)
for await (const event of head.watchServerStatuses({ heartbeatInterval: { seconds: 60n } }, { signal })) {
  console.log(JSON.stringify({ watch: toJson(v1.WatchServerStatusesResponseSchema, event) }));
  if (++received > Number(changes)) break;
}
calls.abort(); // leaving the loop does not end the stream; aborting does, and lets Node exit

// Calls a gym_rpc head from TypeScript with the stubs `make stubs` generates; prints one JSON line per answer.
// Run: node_modules/.bin/tsx interop/ts/client.ts 127.0.0.1:50051
import { toJson } from "@bufbuild/protobuf";
import { createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import * as v1 from "../../stubs/ts/gym_rpc/v1/control_plane_pb";

const head = createClient(v1.ControlPlaneService, createGrpcTransport({ baseUrl: `http://${process.argv[2]}` }));
const calls = new AbortController(); // aborted when done, or after 10 s: the program always ends by itself
setTimeout(() => calls.abort(new Error("gave up after 10 s")), 10_000).unref();
const signal = calls.signal;

const config = await head.getGlobalConfig({}, { signal });
console.log(JSON.stringify({ config: toJson(v1.GetGlobalConfigResponseSchema, config) }));
const statuses = await head.listServerStatuses({}, { signal });
console.log(JSON.stringify({ statuses: toJson(v1.ListServerStatusesResponseSchema, statuses) }));
let received = 0; // a snapshot first, then each change (no heartbeat within a minute)
for await (const event of head.watchServerStatuses({ heartbeatInterval: { seconds: 60n } }, { signal })) {
  console.log(JSON.stringify({ watch: toJson(v1.WatchServerStatusesResponseSchema, event) }));
  if (++received === 2) break;
}
calls.abort(); // leaving the loop does not end the stream; aborting does, and lets Node exit

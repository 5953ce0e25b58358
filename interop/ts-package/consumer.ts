// A project that installed the stubs package (`npm install gym-rpc-control-plane-<version>.tgz`): it imports the
// messages and the service descriptor by package name and round-trips a message through the binary encoding.
import { create, fromBinary, toBinary, toJson } from "@bufbuild/protobuf";
import {
  ControlPlaneService,
  ServerStatus,
  WatchServerStatusesResponseSchema,
  WatchEventType,
} from "@gym-rpc/control-plane";

const event = create(WatchServerStatusesResponseSchema, {
  type: WatchEventType.CHANGE,
  revision: 42n,
  reports: [{ serverName: "policy_model", status: ServerStatus.SUCCESS }],
});
const decoded = fromBinary(WatchServerStatusesResponseSchema, toBinary(WatchServerStatusesResponseSchema, event));
const methods: string[] = ControlPlaneService.methods.map((method) => method.name);
console.log(JSON.stringify({ service: ControlPlaneService.typeName, methods, event: toJson(WatchServerStatusesResponseSchema, decoded) }));

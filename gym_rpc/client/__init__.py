"""The gym_rpc client: ServerClient (control plane over gRPC, data plane over aiohttp) and rollout URL prefixes."""

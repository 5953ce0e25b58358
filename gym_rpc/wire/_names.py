"""Names both ends of the control plane must spell the same: the service, metadata keys, environment variables,
message-size limits. Kept here so the client and the server never import each other for a string."""

from __future__ import annotations

from gym_rpc._environment import HEAD_ADDRESS_ENV_VAR as HEAD_ADDRESS_ENV_VAR  # read by gym_rpc._environment
from gym_rpc._environment import TLS_CA_ENV_VAR as TLS_CA_ENV_VAR
from gym_rpc._environment import TLS_CERT_ENV_VAR as TLS_CERT_ENV_VAR
from gym_rpc._environment import TLS_KEY_ENV_VAR as TLS_KEY_ENV_VAR
from gym_rpc._environment import TOKEN_ENV_VAR as TOKEN_ENV_VAR
from gym_rpc._environment import WATCH_RELAY_ENV_VAR as WATCH_RELAY_ENV_VAR

# The contract's service (proto/gym_rpc/v1): spelt out, so naming it loads no generated code (a test checks it is
# the descriptor's name).
SERVICE_NAME = "gym_rpc.v1.ControlPlaneService"
CONTROL_METHOD_PREFIX = f"/{SERVICE_NAME}/"
HEALTH_SERVICE_NAME = "grpc.health.v1.Health"
HEALTH_METHOD_PREFIX = f"/{HEALTH_SERVICE_NAME}/"

AUTHORIZATION_METADATA_KEY = "authorization"


MIB = 1024 * 1024
MAX_REQUEST_BYTES = 4 * MIB  # head: every request is a name or a few numbers
MAX_RESPONSE_BYTES = 64 * MIB  # a global config with thousands of servers still fits

"""The head's HTTP side: NeMo Gym's HTTP head endpoints, the status page at /ui/ and its data, the service over
the Connect protocol, and a CPU budget for decoding Connect bodies."""

from gym_rpc.server.http._connect import ConnectServer as ConnectServer
from gym_rpc.server.http._nemo_gym_endpoints import HttpHead as HttpHead
from gym_rpc.server.http._status_page import PageServer as PageServer
from gym_rpc.server.http._status_page import StatusPage as StatusPage

"""The test suite. Imported before tests/conftest.py and so before anything in a test process imports grpc.

gRPC's fork support is turned off here, for every test process and what it starts: grpcio (1.81 and later) runs a
post-fork handler in the child of every real fork(), and that handler starts a polling thread which races the
child's own Python (os.register_at_fork handlers, a subprocess preexec_fn) before exec. While grpc calls are under
way in the parent (a head in the test's loop, a follower streaming), the child then dies of SIGSEGV or SIGABRT
before it execs (grpc/grpc#43055). Ray's ray.init forks its GCS and raylet with a preexec_fn, so a local Ray
started beside a live head lost its GCS in about one start in five ("Timed out waiting for file
.../gcs_server_port_...", an empty logs/). Nothing in the suite uses grpc in a forked child that goes on without
exec, which is all that fork support is for. grpc reads the variable once, when it is imported, so it is set
before that, not with setdefault: a value from the shell would bring the crashes back.
tests/project/test_suite_guarantees.py checks that it took effect.
"""

import os

os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"

"""Generated from proto/gym_rpc/v1 by tools/generate_python_stubs.py. Do not edit."""

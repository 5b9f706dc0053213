"""The gRPC runtime every service runs on: listeners, TLS and tokens, per-RPC wrapping, health, reflection."""

"""Benchmarks: the cost of a toolmesh tool call against a bare gRPC floor and the MCP SDK.

Run `python -m bench` from the repository root (see bench/README.md).
"""

"""MCP both ways: a gateway that serves a session's tools to MCP clients, and MCP servers as hosts.

Needs the `mcp` extra (`pip install 'toolmesh[mcp]'`): the MCP Python SDK.
`toolmesh.mcp.gateway` serves tools/list and tools/call from the registry and
the invocation service (over stdio or streamable HTTP, `toolmesh mcp`);
`toolmesh.mcp.upstream` puts an MCP server's tools into a session and serves
each call by calling that server (`toolmesh host --mcp`).
"""

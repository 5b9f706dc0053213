"""The `toolmesh` command line: one module per command, assembled in toolmesh.cli.main."""

"""The services put together: one per process, all in one (`toolmesh up`), and their entry points."""

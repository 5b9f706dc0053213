"""The registry service: each session's tool definitions, their schemas and revision, listed and watched."""

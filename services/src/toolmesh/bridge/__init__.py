"""The bridge service: handler hosts connected on a stream, tool requests routed to them, outcomes back."""

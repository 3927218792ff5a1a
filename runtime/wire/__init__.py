"""The wire between the HTTP process and the runtime process: typed messages, their framing, the client.
The only part of runtime/ that server/ imports; it imports nothing of ours."""

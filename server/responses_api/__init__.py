"""OpenAI's Responses API (`POST /v1/responses`, the stored responses) over the chat path: requests
become the chat request /v1/chat/completions runs, its answer and stream chunks become the response
and its events; responses are kept in SQLite (store.py)."""

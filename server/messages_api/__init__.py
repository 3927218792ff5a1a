"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat path:
requests become the chat request /v1/chat/completions runs, its answer and stream chunks become
Anthropic's message and events."""

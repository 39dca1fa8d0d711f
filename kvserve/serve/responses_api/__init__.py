"""`/v1/responses`: OpenAI's Responses API over the chat path.

request.py translates a body into a chat-completions body, the chat path
(generation/: prompts.chat_prompt, submit.start_chat, stream.py) renders,
submits and answers it, and
output.py renders chat's answer as a Response object or typed events.
store.py keeps responses for GET, DELETE and `previous_response_id`;
routes.py wires them. Written by hand: no library serves this API over
another engine; the shapes follow OpenAI's API reference.
"""

"""`/v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the chat path.

request.py translates a body into a chat-completions body, the chat path
(generation/: prompts.chat_prompt, submit.start_chat, stream.py) renders,
submits and answers it, and
output.py renders chat's answer as a Message or as Anthropic's stream events;
routes.py wires them and answers every error in Anthropic's shape. Written
by hand: no library serves this API over another engine; the shapes follow
Anthropic's API reference.
"""

"""One generation request's life, from its checked prompt to its last chunk.

Read in order: prompts.py (a chat body rendered, or completions' prompts
checked), submit.py (the Job made, each prompt handed to the engine thread,
its first output awaited), stream.py (the answer joined or streamed, aborted
when the client leaves), job.py (the Job: what the engine sent, rendered as
OpenAI's bodies and chunks; logprobs.py their log-probabilities). Every API
runs through here: openai/ directly, responses_api/ and messages_api/ after
translating their bodies into chat bodies (chat_blocks.py reads chat's answer
back as their blocks).
"""

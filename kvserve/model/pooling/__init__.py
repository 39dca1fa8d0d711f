"""Final hidden states -> one vector per pooling request (kvserve.pooling_params).

pooler.py: the last token, or the mean over the prompt, its rows kept across chunks and
preemptions until the prompt is complete. Imports no other model room.
"""

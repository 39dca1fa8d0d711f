"""Final hidden states -> one vector per pooling request (kvserve.pooling_params)."""

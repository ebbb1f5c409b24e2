"""Model I/O: what turns conversations into token ids and token ids back into text.

Chat rendering on plain dicts, tool-call parsing, incremental detokenising with stop strings,
and the one tempered log-probability function that serving, judging and training share. It
knows tokenizers and tensors, nothing of HTTP, sessions or rewards.
"""

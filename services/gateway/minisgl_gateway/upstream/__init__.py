"""The gateway's upstream side, shared by every request of the process: which engines there are
(discovery.py), which one a sequence goes to (routing.py over engine_view.py), the link to each
engine's scheduler (scheduler_link.py: its Connect and Watch streams), the one Detokenize stream
(detok.py), the reconnect loop behind every stream (streams.py), and what a request holds of it
(sequence.py). pipeline.py ties them together: submit, cancel, failover.

Knows nothing of the public APIs or of output parsing: requests put token ids in and read
detokenized step events out.
"""

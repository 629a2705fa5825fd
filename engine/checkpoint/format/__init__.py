"""What a checkpoint holds, as bytes: the state tree's keys (``state_keys``), the codec (state
tree <-> msgpack + raw tensor bytes: ``codec``, ``tensor_bytes``, ``encoded_state``, ``bounds``),
sharded tensors (``shards``), the manifest and checksums (``manifest``, ``checksum``), the names
of checkpoints and rank files (``names``, ``rank_files``), what each rank's part holds
(``rank_parts``) and a hash of the trained state (``fingerprint``).

The bottom room of engine.checkpoint: it imports no other room of it.
"""

"""The router's threat model, one module per kind of attacker, each test one attack
reproduced at small scale on loopback (bounded in count and time):

  * test_clients.py — slow, silent and hostile clients (its docstring tables them);
  * test_engine_output.py — an engine that sends endless lines, huge events, huge heads,
    trailers or bodies (upstream.max_event_bytes, E02);
  * test_json_depth.py — a client body nested deeper than the router can write back (R04);
  * test_passthrough.py — a client steering engines with fields only the router may set,
    or that the operator denies (upstream.deny_fields);
  * test_engine_urls.py — engine addresses, credentials and engine bytes leaking to
    clients, /v1/engines, logs or the wire;
  * test_engine_messages.py — engine-supplied values (token IDs, addresses, raw bytes) in
    the messages of E01-E05 and of a failed profile.

`rawengine.py` is the hostile engine they share.
"""

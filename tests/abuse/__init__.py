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
    the messages of E01-E05 and of a failed profile;
  * test_surface.py — the HTTP surface: the servers' own refusals, two credentials;
  * test_watched_files.py, test_fleet_size.py, test_tenant_books.py,
    test_engine_credentials.py, test_fair_retention.py, test_exact_usage.py,
    test_json_logs.py, test_first_event.py, test_migration.py — an operator's and an
    attacker's side (issue 40, docs/hardening.md): watched files and reloads, the fleet's
    size, tenant books, engine credentials and the router's own address, fair retention,
    usage counted by the engine, the JSON log, alerts on the first event, migration.

`rawengine.py` is the hostile engine they share.
"""

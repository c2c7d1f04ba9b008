"""A record channel between nodes on different hosts: ZeroMQ over TCP, CURVE-encrypted.

On one host the processes talk through shared-memory rings; across hosts the same
records (``wire.records``: ``Control`` structs and ``TokenBatch``) travel on a ROUTER
(``LinkServer``, one per listening node) / DEALER (``LinkClient``, one per connection)
pair. Nothing is pickled: a frame is data that ``wire.records.decode`` validates.

Authentication from one shared string
    Every node is started with the same ``--cluster-key``. ``cluster_keypair`` stretches
    it (scrypt, a fixed salt) into a CURVE secret key, so every node derives the same
    keypair without any key file to distribute. The server runs ``curve_server`` with that
    secret; a client names the derived public key as the server's key and presents the
    same pair as its own. That makes the check mutual:

    * a client with another key encrypts its handshake to a server key that does not
      exist, so the server cannot open it and drops the connection (the client sees the
      handshake fail; the server's monitor sees a cryptographic protocol error);
    * a client that knows only the public key (it is not secret: it can leak from a log
      or a config dump) completes the CURVE handshake with a keypair of its own, but the
      server's ZAP handler admits no client key other than the cluster's, and CURVE makes
      a client prove it holds the secret of the key it presents.

    The stretching matters because one recorded handshake lets an eavesdropper test key
    guesses offline; keys shorter than 16 characters are refused outright.

What a refusal looks like
    On the server, each refused connection is one WARNING on the ``transport.link``
    logger with the peer's address: from the ZAP handler (wrong client key) or from the
    socket monitor (handshake failed: wrong key, not CURVE, or closed mid-handshake). A
    monitor event names no peer address, so that address is the one read from the socket
    when the connection was accepted (best effort: "unknown" if it was closed already).
    On the client, ``connect`` watches its own socket monitor and raises ``PeerRefused``
    on the first failed handshake instead of waiting out its timeout; no answer at all
    is ``LinkTimeout``.

Framing
    An application record is exactly one frame, ``wire.records.encode(msg)``, so the hot
    path (a ``TokenBatch`` per engine step) costs no extra frame. The link's own records
    (``wire.link_records``: ``Hello``, ``Beat``, and the gateway's ``Relay``/``Rows``/
    ``Join``/``Welcome``) are two frames, ``[LINK_TAG, msgpack]``, so they need no kind
    byte in ``wire.records``' space. The ROUTER side adds the peer's routing id in front,
    as ZeroMQ does. Anything else (a frame that does not decode, a wrong frame count, a
    record from a peer that has not said Hello) is logged as ``BadFrame``, counted in
    ``bad_frames`` and dropped; the link carries on.

Liveness
    A client sends ``Hello`` on connect and the server answers with its own; only then does
    it accept the client's records. Either side may ``send_beat``; every message heard
    (beats included) refreshes the sender's ``last_heard``, and ``silent_peers(after_s)``
    lists the peers not heard within ``after_s``. ZMTP heartbeats are also on, so ZeroMQ
    itself drops a dead TCP connection and a send to it raises ``PeerGone``. Liveness is
    updated by ``recv``: the owner is expected to call it regularly. A client that
    reconnects (its server restarted, or ZeroMQ dropped a dead connection) gets a new
    routing id on the server, so it says Hello again and is a new peer there; the old
    entry goes silent and the owner ``forget``s it.

Where it lives: ``auth`` (the key, the ZAP handler and the handshake monitor),
``endpoint`` (what both ends set up alike: socket options, framing, sends), ``server``
(``LinkServer``) and ``client`` (``LinkClient``).

Threads: a link object belongs to one thread. The server runs one guard thread of its
own, which owns only the ZAP and monitor sockets; ``close`` stops it.
"""

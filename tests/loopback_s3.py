"""An S3Store talking to a loopback ``http.server`` that answers as a test's handler class says.

For what a real server cannot be made to do on purpose (answer a range it was
not asked for, record the headers of each request); the integration tests
talk to SeaweedFS (tests/seaweed.py).
"""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator

from ogrefs.store.s3 import S3Store


@contextlib.contextmanager
def loopback_store(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[S3Store]:
    """A store of bucket ``bkt``, prefix ``p``, whose requests ``handler`` answers (the caller sets the AWS keys)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    store = S3Store("bkt", "p", endpoint_url=f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield store
    finally:
        store.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)

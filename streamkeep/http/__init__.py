"""The HTTP edges: bytes in, `protocol.model.Request` to the service, its `Response` back out as
bytes; no stream logic here. listen.py starts the edge the settings choose, and the metrics port.

The lean edge (the default) is a trio task per connection:
- accept.py: accepts connections (TLS handshake, then HTTP/1.1 or HTTP/2 by ALPN or preface),
  closes idle ones, drains them at shutdown;
- h1_parser.py, h1_connection.py, h1_writer.py: HTTP/1.1 parsed by llhttp, served, encoded;
- h2_connection.py, h2_validate.py, h2_encoder.py: HTTP/2 with h2, request header checks, HPACK;
- edge.py (what the edges share), budget.py (the in-flight body cap), sockets.py (plain TCP
  I/O without trio's stream), reasons.py (status line phrases), metrics_port.py (--metrics-port).

The other edge, `--edge quart`, is quart-trio on hypercorn: quart_app.py and hypercorn_fixes.py.
"""

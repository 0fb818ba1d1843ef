"""The HTTP edge, adapting HTTP to `streamkeep.service`: by default the lean edge (a trio task per
connection driving llhttp for HTTP/1.1 and h2 for HTTP/2), or quart-trio on hypercorn (`--edge
quart`); server.py starts either."""

"""The HTTP edge: quart-trio on hypercorn's trio worker, adapting HTTP to `streamkeep.service`."""

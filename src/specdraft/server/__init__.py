"""An OpenAI-compatible HTTP server over the speculative decoder (`specdraft serve`).

app.py (routes, auth, the playground, who shares cross-request memory), schemas.py (request
bodies), prepare.py (a request checked and turned into token ids and sampling), decoders.py (the
speculation a request may ask for, and the drafters its sequences get, with the memory of earlier
requests of its cache salt), worker.py (the bounded queue and the one engine thread, batching
continuously), responses.py (OpenAI response bodies and stream chunks), metrics.py (Prometheus
text), errors.py (OpenAI-style error JSON).
"""

from specdraft.server.app import ServerSettings, create_app
from specdraft.server.decoders import DecoderPool

__all__ = ["DecoderPool", "ServerSettings", "create_app"]

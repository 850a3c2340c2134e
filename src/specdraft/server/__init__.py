"""An OpenAI-compatible HTTP server over the speculative decoder (`specdraft serve`).

app.py (routes, auth, the playground, who shares cross-request memory), schemas.py (request
bodies), prepare.py (a request checked and turned into token ids and sampling), decoders.py (one
decoder per drafter, k and memory partition, built on demand, the least recently used dropped
past a bound), worker.py (the bounded queue and the one engine thread), responses.py (OpenAI
response bodies and stream chunks), metrics.py (Prometheus text), errors.py (OpenAI-style error
JSON).
"""

from specdraft.server.app import ServerSettings, create_app
from specdraft.server.decoders import DecoderPool

__all__ = ["DecoderPool", "ServerSettings", "create_app"]

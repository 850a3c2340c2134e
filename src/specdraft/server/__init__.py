"""An OpenAI-compatible HTTP server over the speculative decoder (`specdraft serve`).

app.py (the route handlers, auth, the playground, and `create_app` wiring them), settings.py
(`ServerSettings`; who shares cross-request memory), middleware.py (request counts, the body limit), schemas.py (request
bodies), prepare.py (a request checked and turned into token ids and sampling), decoders.py (the
speculation a request may ask for, and the drafters its sequences get, with the memory of earlier
requests of its cache salt), worker.py (the bounded queue and the one engine thread, batching
continuously), responses.py (OpenAI response bodies and stream chunks), metrics.py (Prometheus
text), errors.py (OpenAI-style error JSON).
"""

from specdraft.extras import require

require("server", "specdraft's server", "fastapi", "pydantic")

from specdraft.server.app import create_app  # noqa: E402  (after the check: fastapi is the `server` extra)
from specdraft.server.decoders import DecoderPool  # noqa: E402
from specdraft.server.settings import ServerSettings  # noqa: E402

__all__ = ["DecoderPool", "ServerSettings", "create_app"]

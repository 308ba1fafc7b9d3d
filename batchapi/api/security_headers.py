"""Headers that tell a browser what it may do with a response. Every response: ``nosniff`` (a
JSONL download or an error body is never run as a script or a page). Every ``/dashboard``
response, its static files and errors included: a strict Content-Security-Policy (scripts,
styles, images and requests from the dashboard's own origin only, no inline script or style, no
plugins, forms posted back to it) that also forbids framing it (``frame-ancestors 'none'``, and
``X-Frame-Options`` for browsers that predate it), and no Referer sent from its pages to another
site (a page's URL names batch ids). ``same-origin``, not ``no-referrer``: under ``no-referrer`` a
browser sends ``Origin: null`` with the sign-in form, which the sign-in's cross-site check refuses.
The pages need nothing more: one static script, one static stylesheet, SVG drawn on the server."""

from __future__ import annotations

DASHBOARD = "/dashboard"
CONTENT_SECURITY_POLICY = ("default-src 'self'; base-uri 'none'; object-src 'none'; form-action 'self'; "
                           "frame-ancestors 'none'")
EVERY = [(b"x-content-type-options", b"nosniff")]
DASHBOARD_ONLY = [(b"content-security-policy", CONTENT_SECURITY_POLICY.encode()), (b"x-frame-options", b"DENY"),
                  (b"referrer-policy", b"same-origin")]


class SecurityHeaders:
    """A pure ASGI middleware (a streamed download stays streamed), adding the headers above to
    each response that does not set them itself."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        added = EVERY + (DASHBOARD_ONLY if path == DASHBOARD or path.startswith(DASHBOARD + "/") else [])

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(name, value) for name, value in added if name not in present]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)

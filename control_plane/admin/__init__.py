"""Admin: the control plane's HTTP for operators and the live view.

``http`` is the server (routes, their guards and limits; ``bounded_server`` caps its
connections), ``tokens`` the read and write tokens and the exposure check, ``api`` what each
route does for an operator (status, overrides, splits, canaries), ``live_view`` the frames the
page at ``/ui`` (static files in ``ui/``) draws. Nothing below this layer imports it
(import-linter).
"""

from control_plane.lazy import exports

__getattr__, __all__ = exports(
    __name__,
    {
        "AdminError": "http",
        "AdminServer": "http",
        "AdminTokens": "tokens",
        "LiveFeed": "live_view",
        "OperatorApi": "api",
    },
)

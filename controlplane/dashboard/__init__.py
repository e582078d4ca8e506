"""The admin dashboard: the cluster live, any past moment, and each replica's history (docs/dashboard.md).

`model.py` folds the log (pure, no I/O); `server.py` serves the page and the JSON API over aiohttp;
`static/` is the page itself (plain HTML, CSS and JS modules: no build step).
"""

from controlplane.dashboard.model import DashboardModel
from controlplane.dashboard.server import DEFAULT_HOST, DEFAULT_PORT, Dashboard, serve

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "Dashboard", "DashboardModel", "serve"]

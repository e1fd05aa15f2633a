"""`capsvc.client`: the Python client, as the service's own package names it. The client is
its own distribution, `capsvc-client` (package `capsvc_client`, built from `client/`):
this module is that package's API under the service's name."""

from capsvc_client import *  # noqa: F403
from capsvc_client import __all__ as __all__

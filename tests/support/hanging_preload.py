"""A preload module that never returns, as one waiting on a service that never answers would."""

import threading

threading.Event().wait()

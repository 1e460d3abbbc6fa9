"""Lightning precision plugins that train with a precision plan."""

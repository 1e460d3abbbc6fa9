"""The precision plan: entries, selectors, fingerprint, file format."""

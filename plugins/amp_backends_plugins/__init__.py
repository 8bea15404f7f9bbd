"""The backends amp-backends ships, each an ordinary plugin in the ``amp_backends`` entry-point group."""

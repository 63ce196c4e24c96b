"""Model families: one definition each, used by every path."""

"""An invoice → accounting export → notification chain, one outbox step feeding the next."""

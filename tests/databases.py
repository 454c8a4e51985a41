"""Throwaway databases on the server the tests use (one implementation, shared with the plugin)."""

from outbox.testing.databases import fresh_database as fresh_database

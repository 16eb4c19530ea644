"""The HTTP surface: the app and its handlers, request bodies, errors, auth and tenants."""

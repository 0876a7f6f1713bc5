"""Who may do what, without SQL: OIDC tokens, the sealing of secrets, group mappings.
The SQL of tokens, teams, secrets and the audit trail is in ``services.core.db``."""

"""Who may do what: tokens, OIDC, teams, secrets, and the audit trail of it all."""

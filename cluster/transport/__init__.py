"""Token feeds: one TCP connection per (ingress replica, engine or router) for the calls of a
request's path and the token events that come back (`token_feed`: protocol and client end,
`feed_server`: serving end), and the orchestrator's clients over them (`handles`)."""

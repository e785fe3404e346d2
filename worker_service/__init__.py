"""A worker that takes either role (`pdmesh worker --role`): the decode and prefill services over
one engine and one KV connector that both receives and pushes; the router sets its role."""

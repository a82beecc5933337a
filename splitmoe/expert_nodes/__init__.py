"""Expert ranks: hold a share of the routed experts and run the grouped FFN for the tokens they
receive, returning one weighted partial sum per token."""

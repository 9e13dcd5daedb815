"""The data path: where images live, how they are listed, split, checked, fetched and decoded."""

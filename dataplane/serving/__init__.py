"""The serving side: user requests in, results out (dispatcher, processors, pull, replica link, client SDK)."""

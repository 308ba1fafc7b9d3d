"""The Uploads API's service (OpenAI's ``/v1/uploads``): a large file sent in parts."""
